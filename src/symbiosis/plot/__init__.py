"""PLOT (HMI): precomputed lookup tables that stand in for a model's lower layers. table.py: the files; build.py:
making them from a corpus; lookup.py: a domain's lookups and their aggregation; split.py: the model cut at layer k;
device.py: the same lookups on a device, a batch at once; model.py: inference on the upper layers."""

from symbiosis.plot.build import CorpusTooSmall, Stopped, build_table
from symbiosis.plot.device import DevicePlot
from symbiosis.plot.lookup import Plot
from symbiosis.plot.model import Generation, PlotModel, generate_many
from symbiosis.plot.split import LowerLayers, UnsupportedModel, UpperModel
from symbiosis.plot.table import PlotTable, PlotTableError

__all__ = ["CorpusTooSmall", "DevicePlot", "Generation", "LowerLayers", "Plot", "PlotModel", "PlotTable", "PlotTableError", "Stopped", "UnsupportedModel",
           "UpperModel", "build_table", "generate_many"]
