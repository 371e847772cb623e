"""`xsa-lm export`: trained models as Hugging Face transformers models (run.py); configuration_xsa.py and
modeling_xsa.py are the modelling code copied beside every exported model (they import only torch and transformers)."""
