#!/usr/bin/env bash
# Make the data set the one-H200 measurements carry (docs/study/h200/README.md), here, from this machine's own
# Python: its standard library's source as a JSONL corpus (.gpu/corpus-s, ~11 MB, one record per .py file, sorted
# by path), a 16,000-piece tokenizer trained on it (.gpu/tok) and its 512/114 span-corruption shards
# (.gpu/shards-s, ~8k examples, well under the 64 MiB carry limit). Rerunning reuses what is there.
#
#   ./scripts/gpu_data.sh          # then carry .gpu/shards-s .gpu/tok (and .gpu/corpus-s for the online loader)
#
# The manifest names the corpus by its path here; the GPU calls link the checkout to /work/main so the online
# loader finds it there too.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
mkdir -p .gpu/corpus-s
if [ ! -s .gpu/corpus-s/stdlib.jsonl ]; then
  python - <<'EOF'
import json, pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["stdlib"])
skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
out = pathlib.Path(".gpu/corpus-s/stdlib.jsonl.tmp")
count = 0
with out.open("w") as f:
    for path in sorted(root.rglob("*.py")):
        if any(part in skip for part in path.relative_to(root).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            f.write(json.dumps({"id": str(path.relative_to(root)), "text": text}) + "\n")
            count += 1
out.rename(out.with_suffix(""))
print(f"[gpu-data] {count} files of {root} -> .gpu/corpus-s/stdlib.jsonl")
EOF
fi
[ -f .gpu/tok/tokenizer.json ] || prep tokenizer --input .gpu/corpus-s/stdlib.jsonl --vocab-size 16000 --out .gpu/tok
[ -f .gpu/shards-s/manifest.json ] || prep corpus --input .gpu/corpus-s/stdlib.jsonl \
  --tokenizer .gpu/tok/tokenizer.json --config configs/prep/mt5-512.yaml --unit-bytes 500000 --shard-rows 2000 \
  --out .gpu/shards-s
prep verify .gpu/shards-s
du -sh .gpu/corpus-s .gpu/tok .gpu/shards-s
