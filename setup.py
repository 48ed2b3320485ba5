"""dist-nce: distributed hard-negative NCE training for entity-linking retrievers."""
from setuptools import find_packages, setup

setup(
    name="dist-nce",
    version="0.1.0",
    description=(
        "Distributed trainer for entity-linking retrievers with hard-negative NCE "
        "(Zhang & Stratos, NAACL 2021) over knowledge bases of millions of entities."
    ),
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dist_nce", "dist_nce.*", "kb", "kb.*"]),
    # the native kernels' sources, compiled on first use (dist_nce/kernels/build.py)
    package_data={"dist_nce.kernels": ["native/*.c", "native/*.h"]},
    # One command per job of jobs/ (each also runs as `python -m dist_nce.cli.<job>`). demo and
    # mini_paper start jobs/*.py of the checkout they are imported from: an editable install.
    entry_points={
        "console_scripts": [
            "dist-nce-aida-finetune = dist_nce.cli.aida_finetune:main",
            "dist-nce-prepare-kb = dist_nce.cli.prepare_kb:main",
            "dist-nce-encode-kb = dist_nce.cli.encode_kb:main",
            "dist-nce-import-encodings = dist_nce.cli.import_encodings:main",
            "dist-nce-evaluate-kilt-aida = dist_nce.cli.evaluate_kilt_aida:main",
            "dist-nce-link = dist_nce.cli.link:main",
            "dist-nce-zeshel-retriever = dist_nce.cli.zeshel_retriever:main",
            "dist-nce-zeshel-reranker = dist_nce.cli.zeshel_reranker:main",
            "dist-nce-zeshel-grid = dist_nce.cli.zeshel_grid:main",
            "dist-nce-bias-experiment = dist_nce.cli.bias_experiment:main",
            "dist-nce-demo = dist_nce.cli.demo:main",
            "dist-nce-mini-paper = dist_nce.cli.mini_paper:main",
            "dist-nce-update-kb = dist_nce.cli.update_kb:main",
        ],
    },
    install_requires=[
        # Floors and bounds only: the exact versions every install gets are in the locks of
        # requirements/ (`make lock`), which scripts/install.sh passes to pip as constraints
        # (torch==2.13.0 there and in install.sh's TORCH_SPEC).
        "torch>=2.3",
        "deepspeed>=0.16",
        "transformers>=4.45",
        # >=2.52: token authentication (RAY_AUTH_MODE=token, ray._raylet.AuthenticationTokenLoader).
        # <2.61: private Ray APIs checked against 2.60 only: ray._raylet's token loader and
        # ray._private.ray_constants (dist_nce/cluster/runtime.py), ray.serve._private.replica
        # (dist_nce/link/serve.py), ray.autoscaler._private (tests/configs). Raise the bound
        # after rechecking those uses on the newer Ray. serve: dist_nce/link/serve.py.
        "ray[default,train,serve]>=2.52,<2.61",
        "numpy>=1.24",
        "pyarrow>=15",
        "tqdm>=4.66",
        "pyyaml>=6.0",
        "tensorboard>=2.15",
        "matplotlib>=3.7",
        "psutil>=5.9",
    ],
    extras_require={
        # FAISS comes from exactly one of these two extras. faiss-cpu and faiss-gpu both own
        # the files of the `faiss` module, so installing both and uninstalling one deletes
        # files the other needs. scripts/install.sh picks one (a GPU if nvidia-smi sees one);
        # a bare `pip install -e .` has no faiss, and dist_nce.cluster.runtime.require_faiss says so.
        # triton on CPU machines: the GPU kernels' logic runs in its interpreter in the tests
        # (dist_nce/kernels/block_reduce.py); CUDA builds of torch bring their own pinned triton.
        "cpu": ["faiss-cpu>=1.8", "triton==3.6.0; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "gpu": ["faiss-gpu>=1.8"],
        # kubernetes-validate ships the Kubernetes OpenAPI schemas, so the cluster-config
        # tests validate pod templates offline; import-linter checks the layering (.importlinter,
        # tests/test_layers.py; its acyclic_siblings contract type is recent).
        # run.tracking (dist_nce/worker/tracking.py, docs/tracking.md): MLflow and W&B through Ray's
        # integrations, each optional and imported only when turned on. mlflow-skinny is the tracking
        # client with the file store and artifact logging, without the UI server (no sqlalchemy,
        # flask, pandas or scikit-learn); floors are the series the tests ran.
        "mlflow": ["mlflow-skinny>=3.17"],
        "wandb": ["wandb>=0.31"],
        # The tracking packages again (not "dist-nce[mlflow,wandb]": the dev layer's lock and the
        # install tests read the dev extra's own package names), so CI's tests run both trackers.
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "kubernetes-validate>=1.30",
                "import-linter>=2.17", "mlflow-skinny>=3.17", "wandb>=0.31"],
    },
)
