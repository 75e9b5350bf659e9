"""How messages and tensors cross processes: the msgpack codecs (engine <-> ranks in
``wire``, client <-> server in ``protocol``), shared memory, and the waiting primitives.

Torch-free (torch is imported lazily where a torch tensor is encoded); imports only
``runtime.core`` of the project. Importing the subpackage loads none of its modules.
"""
