"""Knowledge-base data: readers for the real KILT, AIDA, Zeshel and BLINK formats,
the prepared entity store and mention tables, and synthetic generators."""
