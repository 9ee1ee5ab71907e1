"""KFP component declarations (installed as kubealign.components).

Thin @dsl.component wrappers around kubealign.stages: typed inputs/outputs, the base image from one
module, a call into a stage and no logic. The wrappers arrive with the Kubeflow pipeline issue; the
package exists now so that its install location (kubealign.components, never a top-level
`components`) is fixed and tested from the start.
"""
