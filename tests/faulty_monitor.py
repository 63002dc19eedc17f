"""``run_training_monitor.py`` with test faults: ``python tests/faulty_monitor.py --faults pause_checkpoint_write@2=60
[monitor flags]``.

The checkpoint-write pause (tests/faults.py) is hooked in this process before the real ``run_training_monitor.main``.
"""

from __future__ import annotations

import sys


def main() -> int:
    # tests/faults.py: this script's folder comes first on sys.path
    from faults import pause_checkpoint_writes, split_faults_flag

    try:
        faults, argv = split_faults_flag(sys.argv[1:])
    except ValueError as e:
        print(f"faulty_monitor.py: error: {e}", file=sys.stderr)
        return 2
    pause_checkpoint_writes(faults)
    import run_training_monitor

    return run_training_monitor.main(argv)


if __name__ == "__main__":
    sys.exit(main())
