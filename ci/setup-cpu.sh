#!/usr/bin/env bash
# Install, into the current Python environment, everything the CPU tiers need
# (pool tier, embedded reference target, the kit). Idempotent: a second run
# finds everything satisfied.  torch is pinned first so that nothing pulls a
# multi-GB CUDA build of a newer release.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
PY="${PYTHON:-python3}"
TORCH_PIN="${HYBRID_CONFORMANCE_TORCH:-torch==2.14.1 torchvision==0.29.1}"
SGLANG_PIN="${HYBRID_CONFORMANCE_SGLANG:-sglang==0.5.23}"
[[ "$SGLANG_PIN" =~ ^[0-9]+(\.[0-9]+)+$ ]] && SGLANG_PIN="sglang==$SGLANG_PIN"  # a bare release number

pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# shellcheck disable=SC2086
pipi $TORCH_PIN
pipi -r "$here/requirements-cpu.txt" $TORCH_PIN
# sglang pins CUDA-only packages; its CPU-importable part needs only the list above.
pipi --no-deps "$SGLANG_PIN"
# An older release needs older pins over the set above (conformance/sglang_api/release_pins.py);
# a source checkout (a path) names the release its pins follow in HYBRID_CONFORMANCE_SGLANG_PINS_FOR.
pins_for="${HYBRID_CONFORMANCE_SGLANG_PINS_FOR:-}"
[[ -z "$pins_for" && "$SGLANG_PIN" =~ ^sglang==(.+)$ ]] && pins_for="${BASH_REMATCH[1]}"
if [ -n "$pins_for" ]; then
    release_pins="$("$PY" "$root/conformance/sglang_api/release_pins.py" "$pins_for")"
    # shellcheck disable=SC2086
    [ -z "$release_pins" ] || pipi $release_pins $TORCH_PIN
fi
# Optional: sglang-router's own argument parser validates the PD router command.
pipi --no-deps "${HYBRID_CONFORMANCE_SGLANG_ROUTER:-sglang-router==0.3.2}" || echo "setup-cpu: sglang-router not installed; PD router commands are checked by shape only"
# PD disaggregation on sglang-cpu: SGLang's Mooncake backend over TCP needs the CPU build of
# `mooncake.engine` and, to load it, Debian's RDMA user-space libraries (no RDMA device is used).
MOONCAKE_PIN="${HYBRID_CONFORMANCE_MOONCAKE:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
missing_libs=""
for lib in libibverbs1 librdmacm1; do
    dpkg -s "$lib" >/dev/null 2>&1 || missing_libs="$missing_libs $lib"
done
if [ -n "$missing_libs" ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup-cpu: cannot install$missing_libs (needs root and apt-get); PD cells on sglang-cpu will be 'na' with Mooncake's import error"
    else
        # shellcheck disable=SC2086
        apt-get install -y -q $missing_libs >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $missing_libs >/dev/null; } \
            || echo "setup-cpu: apt-get could not install$missing_libs; PD cells on sglang-cpu will be 'na' with Mooncake's import error"
    fi
fi
pipi "$MOONCAKE_PIN" || echo "setup-cpu: $MOONCAKE_PIN not installed; PD cells on sglang-cpu will be 'na' with SGLang's Mooncake refusal"
pipi --no-deps -e "$root"
"$PY" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "sglang", "lm_eval", "mooncake-transfer-engine-non-cuda", "hybrid-conformance"):
    print(f"setup-cpu: {name}=={md.version(name)}")
PY
