"""Ray Train + DeepSpeed training of retrievers with hard-negative NCE.

Driver side: ``trainer`` (TorchTrainer wiring, printed plan, summary), ``data`` (prepare the KB).
Worker side, as a story in ``loop`` (``train_func``), built from one-concern modules:
``plan`` (derived quantities, data order, query keys), ``batches`` (candidate token ids
from the store), ``pipeline`` (negatives prefetched from the NegativeService, or mined per
epoch), ``refresh`` (when to re-encode the KB, staleness), ``checkpoint`` (exact resume,
no pickle on load), ``evaluate`` (dev recall/accuracy over the whole KB), ``model``
(initialisation, export), ``tb`` (TensorBoard, metrics.jsonl, progress), ``engine``
(DeepSpeed), ``config`` (the job's typed YAML).
"""
