"""Stages 1-3 of the paper, fitted once: EK-FAC curvature (kronfluence), the first stage, the second stage (PCA or SRHT)."""
