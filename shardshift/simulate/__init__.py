"""Planning for models far larger than this machine: their training state as logical tensors built from
published configs (`specs`, `space`), pure metadata, no tensor ever allocated."""
