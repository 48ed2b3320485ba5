"""One shard's index: its configuration, exact and FAISS search over its rows, the re-encode loop,
persisted versions, snapshots and loading. Pure of Ray: the actors (``dist_nce.actors``) hold it."""
