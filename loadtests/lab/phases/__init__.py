"""`hipfire-bench phase-profile`: where the device time of a plain decode step goes."""
