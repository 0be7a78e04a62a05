"""The model of §3 and the code that travels with every saved model folder (`trust_remote_code`): these
modules import only torch, transformers and each other, by single-dot relative imports."""
