"""Every ``local-damage bench`` command: each prints its figures with ratios against a baseline
measured in the same run."""
