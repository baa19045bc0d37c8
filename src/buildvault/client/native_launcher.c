/* buildvault-cc-native: the hit path of buildvault-cc without a Python start-up.
 *
 * Built by `buildvault-cc --install-native`, which writes bv_config.h (the Python, the package
 * and the agent's module list of the buildvault-cc that built it). It asks the running agent
 * for a hit ({"op": "native-compile"}, protocol.py); on a hit the agent has written the outputs
 * and the event line, and this prints the compile's stdout and stderr and exits with its code.
 * Everything else -- no agent, an answer that is not a hit, anything this cannot encode or read,
 * every option of buildvault-cc -- execs buildvault-cc itself with the same arguments, so every
 * decision stays in one place (the agent and launcher.py) and a failure here costs time only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <langinfo.h>
#include <locale.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "bv_config.h"

extern char **environ;

static char **saved_argv;

/* Hand the compile to buildvault-cc (as its -IS fast script starts it). */
static void fallback(void) {
    int argc = 0;
    while (saved_argv[argc]) argc++;
    char **args = calloc((size_t)argc + 5, sizeof(char *));
    if (args) {
        args[0] = (char *)BV_PYTHON;
        args[1] = (char *)"-IS";
        args[2] = (char *)"-c";
        args[3] = (char *)"import sys; sys.path.insert(0, sys.argv.pop(1))\n"
                          "from buildvault.client.launcher import main\nsys.exit(main())";
        /* sys.argv[1] is the package's parent directory, popped before main() reads the rest */
        args[4] = (char *)BV_PACKAGE_PARENT;
        for (int i = 1; i < argc; i++) args[4 + i] = saved_argv[i];
        execv(BV_PYTHON, args);
    }
    fprintf(stderr, "buildvault-cc-native: cannot run %s: %s\n", BV_PYTHON, strerror(errno));
    exit(127);
}

/* A growable buffer; any allocation failure falls back. */
struct buf { unsigned char *data; size_t len, cap; };

static void put(struct buf *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        unsigned char *data = realloc(b->data, cap);
        if (!data) fallback();
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->len, src, n);
    b->len += n;
}

static void put_u32le(struct buf *b, uint32_t v) {
    unsigned char le[4] = {v & 0xff, (v >> 8) & 0xff, (v >> 16) & 0xff, v >> 24};
    put(b, le, 4);
}

/* Strict UTF-8 (no overlong forms, no surrogates): Python would decode such bytes to the same
 * str; anything else reaches Python with surrogate escapes, which only launcher.py handles. */
static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t extra;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) { extra = 1; cp = c & 0x1f; }
        else if (c >= 0xe0 && c <= 0xef) { extra = 2; cp = c & 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { extra = 3; cp = c & 0x07; }
        else return 0;
        if (i + extra >= n) return 0;
        for (size_t k = 1; k <= extra; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if ((extra == 2 && cp < 0x800) || (extra == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += extra + 1;
    }
    return 1;
}

/* marshal's str: 'u', a 4-byte little-endian length, the UTF-8 bytes. */
static void put_str(struct buf *b, const char *s, size_t n) {
    if (!valid_utf8((const unsigned char *)s, n) || n > 0x7fffffff) fallback();
    put(b, "u", 1);
    put_u32le(b, (uint32_t)n);
    put(b, s, n);
}

static void put_cstr(struct buf *b, const char *s) { put_str(b, s, strlen(s)); }

/* What Python's start-up sets LC_CTYPE to in a C locale (PEP 538), or NULL: the environment
 * buildvault-cc would send, and LC_CTYPE is part of a compile's key. */
static const char *coerced_ctype(void) {
    const char *all = getenv("LC_ALL");
    if (all && *all) return NULL;
    setlocale(LC_CTYPE, "");
    const char *now = setlocale(LC_CTYPE, NULL);
    if (!now || strcmp(now, "C") != 0) return NULL;
    static const char *const targets[] = {"C.UTF-8", "C.utf8", "UTF-8", NULL};
    for (int i = 0; targets[i]; i++) {
        if (setlocale(LC_CTYPE, targets[i])) {
            const char *codeset = nl_langinfo(CODESET);
            if (codeset && *codeset) return targets[i];
        }
    }
    return NULL;
}

static const char *env_or_empty(const char *name) {
    const char *v = getenv(name);
    return v ? v : "";
}

/* launcher._socket_path: the agent of this configuration and of this agent code. */
static int socket_path(char *out, size_t size) {
    char dir[4096];
    const char *base = getenv("BUILDVAULT_AGENT_DIR");
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (base && *base) snprintf(dir, sizeof dir, "%s", base);
    else if (runtime && *runtime && stat(runtime, &st) == 0 && S_ISDIR(st.st_mode))
        snprintf(dir, sizeof dir, "%s/buildvault-cc", runtime);
    else snprintf(dir, sizeof dir, "/tmp/buildvault-cc-%u", (unsigned)getuid());
    /* launcher._private: the socket accepts compiles, so only a directory of ours counts. */
    if (stat(dir, &st) != 0 || st.st_uid != getuid() || (st.st_mode & 077)) return -1;

    long long code = 0;
    char path[4096];
    for (int i = 0; BV_MODULES[i]; i++) {
        snprintf(path, sizeof path, "%s/%s", BV_CLIENT_DIR, BV_MODULES[i]);
        if (stat(path, &st) == 0) code ^= (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    }
    char code_text[32];
    snprintf(code_text, sizeof code_text, "%lld", code);
    const char *parts[] = {
        env_or_empty("BUILDVAULT_REMOTE"), env_or_empty("BUILDVAULT_INSTANCE"),
        env_or_empty("BUILDVAULT_WRITER"), env_or_empty("BUILDVAULT_TIMEOUT"),
        env_or_empty("BUILDVAULT_TOKEN"), env_or_empty("BUILDVAULT_TOKEN_FILE"),
        env_or_empty("BUILDVAULT_TLS_CA"), BV_PYTHON, code_text,
    };
    uint32_t h = 0x811c9dc5u;  /* FNV-1a over the parts joined by NUL, as launcher._fnv1a */
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        size_t n = strlen(parts[i]);
        if (!valid_utf8((const unsigned char *)parts[i], n)) return -1;
        if (i) h = (h ^ 0u) * 0x01000193u;
        for (size_t k = 0; k < n; k++) h = (h ^ (unsigned char)parts[i][k]) * 0x01000193u;
    }
    int written = snprintf(out, size, "%s/agent-%08x.sock", dir, h);
    return written > 0 && (size_t)written < size ? 0 : -1;
}

static int read_exact(int fd, void *dst, size_t n) {
    unsigned char *p = dst;
    while (n) {
        ssize_t got = read(fd, p, n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void write_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t put_n = write(fd, p, n);
        if (put_n < 0 && errno == EINTR) continue;
        if (put_n <= 0) return;  /* a closed stdout is the build tool's business, not the compile's */
        p += put_n;
        n -= (size_t)put_n;
    }
}

int main(int argc, char **argv) {
    saved_argv = argv;
    const char *disable = env_or_empty("BUILDVAULT_DISABLE");
    if (argc < 2 || argv[1][0] == '-' || !*env_or_empty("BUILDVAULT_REMOTE") || !strcmp(disable, "1") ||
        !strcmp(disable, "true"))
        fallback();

    char path[4200];
    if (socket_path(path, sizeof path) != 0) fallback();
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) fallback();
    strcpy(addr.sun_path, path);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0 || connect(sock, (struct sockaddr *)&addr, sizeof addr) != 0) fallback();

    char cwd[8192];
    if (!getcwd(cwd, sizeof cwd)) fallback();
    const char *ctype = coerced_ctype();

    /* {"op": "native-compile", "argv": [...], "cwd": ..., "env": {...}} in marshal's format */
    struct buf b = {0};
    put(&b, "\0\0\0\0{", 5);  /* room for the length prefix */
    put_cstr(&b, "op");
    put_cstr(&b, "native-compile");
    put_cstr(&b, "argv");
    put(&b, "[", 1);
    put_u32le(&b, (uint32_t)(argc - 1));
    for (int i = 1; i < argc; i++) put_cstr(&b, argv[i]);
    put_cstr(&b, "cwd");
    put_cstr(&b, cwd);
    put_cstr(&b, "env");
    put(&b, "{", 1);
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        /* Odd environments (no '=', an empty or repeated name) are left to os.environ's rules. */
        if (!eq || eq == *e) fallback();
        for (char **f = environ; f != e; f++)
            if (!strncmp(*f, *e, (size_t)(eq - *e) + 1)) fallback();
        if (ctype && (size_t)(eq - *e) == 8 && !strncmp(*e, "LC_CTYPE", 8)) continue;
        put_str(&b, *e, (size_t)(eq - *e));
        put_cstr(&b, eq + 1);
    }
    if (ctype) {
        put_cstr(&b, "LC_CTYPE");
        put_cstr(&b, ctype);
    }
    put(&b, "0", 1);  /* end of env */
    put(&b, "0", 1);  /* end of the request */
    uint32_t body = (uint32_t)(b.len - 4);
    unsigned char prefix[4] = {body >> 24, (body >> 16) & 0xff, (body >> 8) & 0xff, body & 0xff};
    memcpy(b.data, prefix, 4);
    for (size_t sent = 0; sent < b.len;) {
        ssize_t n = send(sock, b.data + sent, b.len - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fallback();
        sent += (size_t)n;
    }

    unsigned char header[4];
    if (read_exact(sock, header, 4) != 0) fallback();
    uint32_t n = be32(header);
    if (n < 1 || n > (256u << 20)) fallback();
    unsigned char *reply = malloc(n);
    if (!reply || read_exact(sock, reply, n) != 0 || reply[0] != 'H' || n < 17) fallback();
    close(sock);

    /* b"H", exit code, then stdout, stderr, warning as (length, bytes): protocol.plain_hit */
    int32_t code = (int32_t)be32(reply + 1);
    size_t at = 5;
    const unsigned char *field[3];
    uint32_t len[3];
    for (int i = 0; i < 3; i++) {
        if (at + 4 > n) fallback();
        len[i] = be32(reply + at);
        at += 4;
        if (len[i] > n - at) fallback();
        field[i] = reply + at;
        at += len[i];
    }
    if (len[2]) {
        write_all(2, field[2], len[2]);
        write_all(2, (const unsigned char *)"\n", 1);
    }
    write_all(1, field[0], len[0]);
    write_all(2, field[1], len[1]);
    return code;
}
