"""`python -m specdecode.kernels`: build the kernel now (make install runs it) and say which
paths this machine runs, which passed the self-check and which one products take."""

from __future__ import annotations

import sys

from . import available, chosen_isa, runnable_isas, selfcheck


def main() -> int:
    if not available():
        return 0  # the one line is said; the other formats run
    runs = runnable_isas()
    checked = [isa for isa in runs if selfcheck(isa)]
    print(
        f"specdecode: quantized kernel built; paths this CPU runs: {', '.join(runs)}; "
        f"bit-exact against the reference: {', '.join(checked)}; products take {chosen_isa()}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
