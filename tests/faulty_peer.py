"""``run_trainer.py`` with test faults: ``python tests/faulty_peer.py --faults nan_loss@3 [trainer flags]``.

The faults (tests/faults.py) are hooked into this process's training run before the real ``run_trainer.main``.
"""

from __future__ import annotations

import sys


def main() -> int:
    # tests/faults.py: this script's folder comes first on sys.path
    from faults import inject_training_faults, split_faults_flag

    try:
        faults, argv = split_faults_flag(sys.argv[1:])
    except ValueError as e:
        print(f"faulty_peer.py: error: {e}", file=sys.stderr)
        return 2
    inject_training_faults(faults)
    import run_trainer

    return run_trainer.main(argv)


if __name__ == "__main__":
    sys.exit(main())
