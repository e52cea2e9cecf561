"""Feature store (docs/architecture.md, "Feature store"): access-probability placement of feature
rows and adjacency lists over GPU memory and pinned host memory, and the gather that reads them
back."""

from quiver_serve.features.fap import RequestLog, degree_scores, feature_access_probability
from quiver_serve.features.placement import Placement, plan_placement
from quiver_serve.features.store import FeatureStore

__all__ = ["FeatureStore", "Placement", "RequestLog", "degree_scores",
           "feature_access_probability", "plan_placement"]
