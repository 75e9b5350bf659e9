"""The rank process: device pinning, process groups, the EngineCore that runs a plugin, the serve loop."""
