"""Operator scripts that are not library code: demo corpus builder, benchmark drivers, launchers."""
