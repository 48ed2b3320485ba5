"""The bottom layer: artifacts, typed configs, records, BLINK text layouts, tokenizers, model
locations. Imports nothing of the project."""
