"""Other formats and places: conversion from MarianMT and FSMT, CTranslate2 export, the Hub, the model card."""
