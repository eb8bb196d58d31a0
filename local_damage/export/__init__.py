"""Export of a trained run to a self-describing ONNX model.

- :mod:`~local_damage.export.options`: what an export is asked for (``ExportOptions``,
  ``ExportError``; torch-free);
- :mod:`~local_damage.export.run`: the run folder read back (config, summary, model);
- :mod:`~local_damage.export.provenance`: training data, licence, validation and test figures;
- :mod:`~local_damage.export.graph`: the uint8-input graph written as fp32 ONNX;
- :mod:`~local_damage.export.quantize`: int8 and fp16 versions (torch-free);
- :mod:`~local_damage.export.parity`: ONNX Runtime against PyTorch, reduced precision against fp32;
- :mod:`~local_damage.export.model`: the export itself (``export_run``, ``RunExport``);
- :mod:`~local_damage.export.weights`: the fp16 safetensors for ``train --init``.
"""
