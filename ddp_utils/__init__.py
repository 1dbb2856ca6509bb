"""Building blocks for the ddp-recipes entry scripts."""
