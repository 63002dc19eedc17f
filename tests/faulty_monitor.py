"""``run_training_monitor.py`` with test faults:
``python tests/faulty_monitor.py --faults pause_checkpoint_write@2=60 [monitor flags]``.

The checkpoint-write pause (tests/faults.py) is hooked in this process before the real ``run_training_monitor.main``.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # tests/faults.py: this script's folder comes first on sys.path
    from faults import pause_checkpoint_writes, run_with_faults

    import run_training_monitor

    sys.exit(run_with_faults("faulty_monitor.py", sys.argv[1:], pause_checkpoint_writes, run_training_monitor.main))
