# A volunteer peer on a GPU machine: docker run --gpus all --network host collab-train --initial_peers /ip4/...
# The base image's CUDA build of torch satisfies the project's torch range, so pip keeps it.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY arguments.py run_trainer.py run_training_monitor.py run_web.py ./
COPY collab/ collab/
COPY trainer/ trainer/
COPY monitor/ monitor/
COPY web/ web/
COPY data/ data/
RUN pip install . && python -m data.prepare

# hivemind's DHT and averaging traffic; publish it or run with --network host
EXPOSE 31337
ENTRYPOINT ["python", "run_trainer.py", "--host_maddrs", "/ip4/0.0.0.0/tcp/31337"]
