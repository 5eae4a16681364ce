#!/usr/bin/env bash
# Same-run A/B of source variants on one machine: each variant's files swapped into the tree in
# turn, one command run per variant and round, its JSON lines kept with the variant's name.
#
#   benchmarks/ab.sh OUTDIR "COMMAND" VARIANT_DIR [VARIANT_DIR ...]
#   ROUNDS=2 (default) runs the variants in order, twice: base m16 base m16.
#
# A variant directory mirrors the repository: VARIANT_DIR/kernels/cuda/x.cuh replaces
# kernels/cuda/x.cuh while that variant runs; an empty directory is the tree as it is (the
# baseline). Every file any variant touches is saved first and put back after each run and at the
# end, even when the command fails. The JIT caches kernels by source, so swapped kernels rebuild.
# Lines of COMMAND's stdout that start with "{" go to OUTDIR/ab.jsonl with "variant" (the
# directory's name) and "round" first; everything else to the terminal and OUTDIR/ab.log.
# Run it from the repository root (on the GPU machine: after gpu_session.sh's install).
set -uo pipefail
out=${1:?usage: ab.sh OUTDIR COMMAND VARIANT_DIR...}
cmd=${2:?usage: ab.sh OUTDIR COMMAND VARIANT_DIR...}
shift 2
[ $# -ge 1 ] || { echo "ab.sh: no variant directories" >&2; exit 2; }
for v in "$@"; do [ -d "$v" ] || { echo "ab.sh: $v is not a directory" >&2; exit 2; }; done
mkdir -p "$out"
saved=$(mktemp -d)
touched=$(for v in "$@"; do (cd "$v" && find . -type f | sed 's|^\./||'); done | sort -u)
for f in $touched; do
  [ -f "$f" ] || { echo "ab.sh: variant file $f has no counterpart in the tree" >&2; rm -rf "$saved"; exit 2; }
  mkdir -p "$saved/$(dirname "$f")" && cp -p "$f" "$saved/$f"
done
restore() { for f in $touched; do cp -p "$saved/$f" "$f"; done; }
trap 'restore; rm -rf "$saved"' EXIT
for round in $(seq 1 "${ROUNDS:-2}"); do
  for v in "$@"; do
    name=$(basename "$v")
    restore
    (cd "$v" && find . -type f | sed 's|^\./||') | while read -r f; do cp "$v/$f" "$f"; done
    echo "=== $name, round $round $(date -u +%T)" | tee -a "$out/ab.log"
    bash -c "$cmd" 2>>"$out/ab.log" | while IFS= read -r line; do
      case $line in
        "{"*) printf '{"variant": "%s", "round": %s, %s\n' "$name" "$round" "${line#\{}" >>"$out/ab.jsonl" ;;
        *) echo "$line" | tee -a "$out/ab.log" ;;
      esac
    done
  done
done
