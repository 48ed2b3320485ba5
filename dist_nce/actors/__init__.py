"""The Ray actors of the KB: EntityShard, the NegativeService over them, fan-out calls, placement."""
