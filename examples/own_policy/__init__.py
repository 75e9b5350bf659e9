"""Serve your own model: a trained ``nn.Module`` (``model.TinyPolicy``), its safetensors
weights (``make_weights``), and the phyrt plugin that serves them (``plugin.OwnPolicy``).
docs/own-model.md walks through it."""
