"""The monitor: the collaboration's stable entry point, its metrics reporter and the keeper of its checkpoints.

python run_training_monitor.py --experiment_prefix my_run --host_maddrs /ip4/0.0.0.0/tcp/31337 \\
    --identity_path monitor.key --store_checkpoints --repo_path checkpoints/ --metrics_path metrics.jsonl
python run_training_monitor.py --config http://HOST:8000/api/experiments/1/config --config_token TOKEN \\
    --report_url http://HOST:8000/api/experiments/1/metrics
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from arguments import MonitorConfig
from collab.entry import run_program


def run(config: MonitorConfig, stop) -> None:
    # imported once the flags have passed their checks: bad input is answered without loading the model code
    from monitor.run import run_monitor

    run_monitor(config, stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    return run_program("run_training_monitor.py", MonitorConfig, run, argv)


if __name__ == "__main__":
    sys.exit(main())
