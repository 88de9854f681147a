"""The surge controller: forecasts, SLOs, the pure decision rule and the loop that applies it."""
