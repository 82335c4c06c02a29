"""The backends, one package per database; only ``factory`` names them all."""
