"""`buildvault run [options] -- CMD...`: one build step cached through any REAPI v2 cache.

The step's key is a real REAPI Action (spec.py options -> key.py), its outputs an ActionResult
(outputs.py); step.py decides HIT / MISS / SAVED / BYPASS and never lets a cache failure fail
the build. `artifact.py` stores whole-build outputs under an exact key, with pins.
"""
