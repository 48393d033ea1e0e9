# `make image` (docker buildx bake): both image variants, tagged as deploy/ expects them.
variable "REGISTRY" {
  default = "ghcr.io/specdec"
}
variable "TAG" {
  default = "0.1.0"
}

group "default" {
  targets = ["cpu", "cuda"]
}

target "cpu" {
  context    = "."
  dockerfile = "Dockerfile"
  tags       = ["${REGISTRY}/specdec:${TAG}"]
}

target "cuda" {
  inherits = ["cpu"]
  args = {
    TORCH_INDEX = "https://download.pytorch.org/whl/cu130"
  }
  tags = ["${REGISTRY}/specdec:${TAG}-cuda"]
}
