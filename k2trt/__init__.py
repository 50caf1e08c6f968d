"""k2trt: Kimi K2 as per-block ONNX graphs and TensorRT engines, with a runtime that generates text."""

__version__ = "0.1.0"
