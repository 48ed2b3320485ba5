"""Entity index: pure search functions, the EntityShard actor, the NegativeService."""
