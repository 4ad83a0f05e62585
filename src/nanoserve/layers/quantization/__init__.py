"""Quantized weights for the linear layers: which method a checkpoint uses (``spec``, torch-free),
the method objects that create, load and multiply a layer's weights (``methods``), the packed
matrices they multiply with (``packed``) and each format's unpacking (``gguf_blocks``,
``gptq_awq``)."""
