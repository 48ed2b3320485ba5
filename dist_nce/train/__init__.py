"""Ray Train + DeepSpeed training of retrievers with hard-negative NCE.

Driver side: ``driver`` (the one sequence both training jobs run: service, version 0, fit,
summary, KB snapshot), ``trainer`` (TorchTrainer wiring, printed plan, summary), ``data``
(prepare the KB), ``kb_control`` (KB deltas served while training runs).
Worker side, as a story in ``loop`` (``train_func``), built from one-concern modules:
``plan`` (derived quantities, data order, the sampler of ``negatives.mode``), ``batches``
(candidate token ids from the store), ``pipeline`` (negatives prefetched from the
NegativeService, or mined per epoch), ``refresh`` (when to re-encode the KB, staleness),
``checkpoint`` (the retriever's extras on the worker's checkpoint: index bookkeeping, mined
negatives), ``evaluate`` (dev recall/accuracy over the whole KB), ``model`` (initialisation,
export), ``kb_follow`` (KB versions seen by a worker), ``config`` (the job's typed YAML).
What any DeepSpeed worker needs (engine, TensorBoard, checkpoint files) is ``dist_nce.worker``.
"""
