"""The runtime around a model family: the expert cache, the decoders, the expert kernels and
their dispatch, load(), pipeline parallelism.

Imports format, stream and models; never generation, convert or apps."""
