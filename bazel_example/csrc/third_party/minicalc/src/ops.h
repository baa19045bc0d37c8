#pragma once
int minicalc_add(int a, int b);
int minicalc_mul(int a, int b);
