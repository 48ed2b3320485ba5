"""What every Ray Train (DeepSpeed) worker of this project shares, for the retriever and the reranker.

``scaffold``     the worker's story (setup, resume, steps, checkpoints, logging, end) and its
                 Ray Train entry point (device -> DeepSpeed accelerator)
``checkpoint``   engine, RNG and loop state without pickle; trainers add their state and tensors
``engine``       the DeepSpeed engine from a DeepSpeed JSON and the job's overrides
``tb``           TensorBoard, metrics.jsonl, the progress bar
``tracking``     ``run.tracking``: MLflow / W&B through Ray's integrations (rank 0, then the driver's
                 summary scores and model); ``tracking_config`` its settings
``collectives``  torch.distributed helpers that are no-ops for one process
``process_group`` how the workers meet (a file on one machine, TCP across machines)
``launch``       the driver side: the TorchTrainer both jobs run
"""
