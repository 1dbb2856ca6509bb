# The image the Kubernetes manifests run (examples/kubernetes/): the project installed with a
# CUDA build of torch. Build and push once:
#   docker build -t ghcr.io/YOUR_ORG/ddp-recipes:latest --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 .
#   docker push ghcr.io/YOUR_ORG/ddp-recipes:latest
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /workspace
RUN pip install torch torchvision --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY ddp_utils ddp_utils
COPY hydra_plugins hydra_plugins
RUN pip install -e '.[s3,hf,timm,det]'
COPY conf conf
COPY train.py eval.py generate.py ./
# torchrun reads its flags from the PET_* variables the training operator sets
ENTRYPOINT []
CMD ["torchrun", "train.py"]
