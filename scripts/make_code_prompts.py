"""Writes `hf_accel/data/prompts/code_build.jsonl`: HumanEval-style completion prompts made from the Python standard
library, for self-distilling a code index without touching HumanEval's held-out problems.

Each prompt is a public top-level function of a public top-level stdlib module, rendered like a HumanEval problem: its
signature, then its docstring (at most 12 lines) in triple quotes, ending with a newline; the model completes it.
Candidates are in module order (file names sorted), then in source order; every k-th one is taken from the first,
k = candidates // count (at least 1), up to `count`: with 640 candidates, `--count 300` takes every second one and
leaves out the last 40.

Example:
    python scripts/make_code_prompts.py --count 300
"""

import ast
import json
import sys
import sysconfig
from pathlib import Path

from hf_accel.cli import OneLineErrorParser


OUT = Path(__file__).resolve().parents[1] / "hf_accel" / "data" / "prompts" / "code_build.jsonl"


def render(node: ast.FunctionDef, max_doc_lines: int = 12) -> str | None:
    doc = ast.get_docstring(node)
    if not doc or len(doc) < 40 or '"""' in doc or "\\" in doc:
        return None
    lines = doc.strip().splitlines()[:max_doc_lines]
    body = "\n".join(f"    {line}".rstrip() for line in lines)
    return f'def {node.name}({ast.unparse(node.args)}):\n    """\n{body}\n    """\n'


def candidates() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[!_]*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                prompt = render(node)
                if prompt:
                    found.append((path.stem, node.name, prompt))
    return found


def main(argv=None) -> int:
    p = OneLineErrorParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.count < 1:
        p.error(f"--count must be at least 1, got {args.count}")
    found = candidates()
    step = max(1, len(found) // args.count)
    chosen = found[::step][: args.count]
    records = [{"task_id": f"stdlib/{module}.{name}", "prompt": prompt} for module, name, prompt in chosen]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(json.dumps({"out": args.out, "prompts": len(chosen), "candidates": len(found)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
