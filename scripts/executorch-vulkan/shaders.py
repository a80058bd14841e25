"""Copy ExecuTorch's Vulkan GLSL sources, leaving out the shaders this glslc cannot compile.

usage: shaders.py SRC_DIR DST_DIR GLSLC  -> prints JSON {"unsupported_extensions", "dropped_shaders"}

ExecuTorch's generator stops at the first shader glslc rejects.  Every `#extension` the sources
name is tried on a one-line shader; a .glsl (with its .yaml variants) that names an unsupported one,
itself or through the headers it includes, is not copied.  The kernels left out are listed so the
build says what this runtime lacks.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

INCLUDE = re.compile(r'#include\s+"([^"]+)"')
EXTENSION = re.compile(r"#extension\s+(\w+)")


def supported(glslc: str, extension: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "probe.comp")
        src.write_text(f"#version 450\n#extension {extension} : require\nvoid main() {{}}\n")
        run = subprocess.run([glslc, "--target-env=vulkan1.1", str(src), "-o", str(src) + ".spv"], capture_output=True)
        return run.returncode == 0


def main(src: Path, dst: Path, glslc: str) -> dict[str, list[str]]:
    texts = {p.name: p.read_text() for p in src.iterdir() if p.is_file()}
    named = {e for text in texts.values() for e in EXTENSION.findall(text)}
    unsupported = {e for e in named if not supported(glslc, e)}
    needs: dict[str, bool] = {}

    def needs_unsupported(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name not in needs:
            text = texts.get(name, "")
            needs[name] = bool(set(EXTENSION.findall(text)) & unsupported) or any(
                needs_unsupported(inc, seen | {name}) for inc in INCLUDE.findall(text) if inc not in seen)
        return needs[name]

    dst.mkdir(parents=True, exist_ok=True)
    dropped = []
    for name in sorted(texts):
        stem = name.rsplit(".", 1)[0]
        if name.endswith((".glsl", ".yaml")) and needs_unsupported(stem + ".glsl"):
            if name.endswith(".glsl"):
                dropped.append(stem)
            continue
        shutil.copy2(src / name, dst / name)
    return {"unsupported_extensions": sorted(unsupported), "dropped_shaders": dropped}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])))
