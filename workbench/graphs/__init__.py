"""ONNX and TensorRT graphs: reading, checking and saving ONNX files, the fp32/fp16/int8 variants, shape profiles
and engine builds."""
