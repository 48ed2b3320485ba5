"""What every Ray Train (DeepSpeed) worker of this project shares, for the retriever and the reranker.

``collectives``  torch.distributed helpers that are no-ops for one process
``scaffold``     the worker's story (setup, resume, steps, checkpoints, logging, end) and its
                 Ray Train entry point (device -> DeepSpeed accelerator)
``launch``       the driver side: the TorchTrainer both jobs run
"""
