#!/usr/bin/env python3
"""The layering check of src/ (run by the build, CMakeLists.txt: dflash_layering).

Usage: check_layering.py LAYERING SRC

LAYERING has a line "folder: used folders..." per library, written by CMake from the libraries' link
lists. The check fails (exit 1, one line per defect) when that graph has a cycle (static libraries
would still link one), when a file of src/FOLDER includes a header of another folder that FOLDER's
link list does not reach, or when src/ tests DFLASH_HAVE_CUDA (defined for the tests only: src/ asks
gpu/backend.h, and a folder's no_cuda.cpp stands in for its cuda/ half). A folder is the first path component under src/: its cuda/ half (and
ops/cpu, ops/cuda) belong to it.
"""
import re
import sys
from pathlib import Path

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def read_layers(path):
    uses = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            folder, _, rest = line.partition(":")
            uses.setdefault(folder.strip(), set()).update(rest.split())
    return uses


def find_cycle(uses):
    """A folder cycle as a list (first == last), or None."""
    state = {}  # folder -> "open" while on the DFS stack, "done" after

    def visit(f, stack):
        state[f] = "open"
        stack.append(f)
        for g in sorted(uses.get(f, ())):
            if state.get(g) == "open":
                return stack[stack.index(g):] + [g]
            if g not in state and (c := visit(g, stack)):
                return c
        stack.pop()
        state[f] = "done"
        return None

    for f in sorted(uses):
        if f not in state and (c := visit(f, [])):
            return c
    return None


def reachable(uses, f):
    seen, todo = set(), [f]
    while todo:
        for g in uses.get(todo.pop(), ()):
            if g not in seen:
                seen.add(g)
                todo.append(g)
    return seen


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    uses = read_layers(sys.argv[1])
    src = Path(sys.argv[2])
    errors = []
    if cycle := find_cycle(uses):
        errors.append("layering: the link lists form a cycle: " + " -> ".join(cycle))
    allowed = {f: reachable(uses, f) | {f} for f in uses}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        folder = path.relative_to(src).parts[0]
        if folder not in allowed:
            errors.append(f"layering: {path}: folder {folder} has no library in CMakeLists.txt")
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "DFLASH_HAVE_CUDA" in line:
                errors.append(f"layering: {path}:{n}: DFLASH_HAVE_CUDA is not defined in src/; ask "
                              "cuda_backend_built() (gpu/backend.h) or add to the folder's no_cuda.cpp")
            m = INCLUDE.match(line)
            if not m:
                continue
            # "folder/x.h" from src/, else relative to the including file; neither: not ours
            header = next((h for h in (src / m.group(1), path.parent / m.group(1)) if h.is_file()), None)
            if header is None:
                continue
            to = header.resolve().relative_to(src.resolve()).parts[0]
            if to not in allowed[folder]:
                errors.append(f"layering: {path}:{n}: {folder} includes {m.group(1)}, but {folder} may use only "
                              f"{', '.join(sorted(allowed[folder] - {folder})) or 'no other folder'}")
    for e in errors:
        print(e, file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
