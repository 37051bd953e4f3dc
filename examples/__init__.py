"""Example models and scripts for autoshard (``from examples.models import llama_tiny``)."""
