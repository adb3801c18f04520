"""Text generation with a Qwen3 model (or Qwen3-MoE), one megakernel launch per step: greedy, or
sampled on the device with --temperature (--top-k, --top-p, --seed).

    python examples/qwen3.py --random-weights                              # the qwen3-tiny preset
    python examples/qwen3.py --preset qwen3-0.6b --random-weights --max-new-tokens 16
    python examples/qwen3.py --model /path/to/Qwen3-0.6B --prompt "Hello"

Text streams to stdout as it is generated (until EOS unless --ignore-eos); a batch prints each
sequence's line as it finishes; --json adds one JSON object as the last line. Ctrl-C stops it with
what was generated so far (exit status 130). See docs/models.md.
"""

import sys

try:
    from megaegg.models.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch imports: no traceback
    print("interrupted: stopped before the first step", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    try:
        main("qwen3")  # (handles Ctrl-C itself: what was generated so far, status 130)
    except KeyboardInterrupt:  # (a Ctrl-C in the moment after it returned)
        sys.exit(130)
