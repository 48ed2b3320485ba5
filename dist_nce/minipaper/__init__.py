"""The paper's Tables 1 and 2 in miniature, over several seeds: spec, cells, statistics, report."""
