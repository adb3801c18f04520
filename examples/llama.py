"""Text generation with a Llama 3.x model, one megakernel launch per step: greedy, or sampled on the
device with --temperature (--top-k, --top-p, --seed).

    python examples/llama.py --random-weights --max-new-tokens 16          # the tiny preset
    python examples/llama.py --preset llama-3.2-1b --random-weights --prompt-ids 1 2 3
    python examples/llama.py --model /path/to/Llama-3.2-1B --prompt "The capital of France is"
    python examples/llama.py --random-weights --prompt-ids-file prompts.json --temperature 0.8 --seed 1

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
        main("llama")  # (handles Ctrl-C itself: what was generated so far, status 130)
    except KeyboardInterrupt:  # (a Ctrl-C in the moment after it returned)
        sys.exit(130)
