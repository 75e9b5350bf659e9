"""Built-in plugins and the tensor-parallel layers they are made of."""
