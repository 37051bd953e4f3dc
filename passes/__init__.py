"""Graph passes: capture, named dims, op rules, SPMD rewrite (imported as ``autoshard.passes``)."""
